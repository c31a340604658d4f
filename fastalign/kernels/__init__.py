"""Triton kernels, one op per file. Imported lazily by ``fastalign.ops`` so that fastalign works
without Triton (e.g. on macOS) through its PyTorch backend."""
