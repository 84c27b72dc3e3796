"""The vcuda-agent command line."""
