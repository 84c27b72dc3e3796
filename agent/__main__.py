"""`python -m agent` runs the CLI."""

import sys

SIM_COMMANDS = ("sim-gpu", "sim-workload", "sim-event", "sim-mps-control")


def _main() -> int:
    if sys.argv[1:2] and sys.argv[1] in SIM_COMMANDS:
        # The light path: simulated workloads must start fast (see agent.surfaces.cli.sim.sim_main).
        from agent.surfaces.cli.sim import sim_main  # noqa: PLC0415

        return sim_main(sys.argv[1:])
    from agent.surfaces.cli.main import main  # noqa: PLC0415

    return main()


if __name__ == "__main__":
    raise SystemExit(_main())
