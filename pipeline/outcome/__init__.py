"""What a run concludes: metrics.json, the verdict over seeds with rliable's statistics, and the
human review of a run's policies."""
