"""Planning capture sizes from batch-size histograms (DESIGN.md section 6)."""
