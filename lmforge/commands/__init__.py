"""CLI subcommands: each module parses its arguments and calls library functions."""
