"""Run reports: report.md with final metrics, plots, data, config diff and environment."""
