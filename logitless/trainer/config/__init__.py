"""The run's configuration: the config sections and their loading (`schema`), the run folder's config files and
what a resumed run may change (`files`), and docs/configuration.md generated from the sections (`docs`)."""
