"""The application: run configuration, recipes, the run pipeline, plan, reports, tracking."""
