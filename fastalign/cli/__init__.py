"""``fastalign`` command line: thin, parses arguments and calls the library."""
