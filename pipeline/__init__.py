"""The only code that calls Ray: config, the DAG, the runner, run dirs and the CLI."""
