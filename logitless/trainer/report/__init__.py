"""What a run reports: metrics sinks and the progress bar (`metrics`), experiment trackers (`tracking`), where a
step's time and memory go (`accounting`), the training curves (`plot`)."""
