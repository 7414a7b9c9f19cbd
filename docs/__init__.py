"""The repository's docs; `docs.generate` writes the generated references (`make docs`)."""
