"""colibri storage: container format, quantization, conversion, expert reads (bytes on disk)."""
