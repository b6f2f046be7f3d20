"""The `tokenmill` command's subcommands, one module per group (tokenmill/cli.py builds the parser)."""
