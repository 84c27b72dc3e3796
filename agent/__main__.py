"""`python -m agent` runs the CLI."""

from agent.surfaces.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
