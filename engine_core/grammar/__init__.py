"""Grammar-constrained decoding with xgrammar: specs, compilation, per-sequence matchers,
token bitmasks (docs/design/structured-outputs.md)."""
