"""Planning capture sizes from batch-size histograms (docs/architecture.md, "Capture-size planner")."""
