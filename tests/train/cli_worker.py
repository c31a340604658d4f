"""Under torchrun: the ``fastalign`` command line itself (``python -m fastalign``'s ``main()``)."""

from fastalign.cli.main import main

if __name__ == "__main__":
    main()
