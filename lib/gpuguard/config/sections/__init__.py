"""The config sections of the features, one module each (gpuguard.config.model assembles them into `Config`)."""
