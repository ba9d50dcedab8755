"""Layer 1, core: errors, the typed schema, the dtype table, file I/O and the atomic folder writer,
runtime/device selection. Imports nothing else of ms_deepseek (see ARCHITECTURE.md)."""
