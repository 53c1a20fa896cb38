"""The quantization schemes `lmforge quantize` offers: the one list that the command line, the
pipeline's stage schema and the torchao code read (torch-free, so `--help` stays light)."""

SCHEMES = ("int8-wo", "int4-wo")
