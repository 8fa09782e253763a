"""SpecLens engine: exact speculative decoding. Knows nothing about Qt."""
