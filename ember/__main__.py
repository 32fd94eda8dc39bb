"""``python -m ember`` runs the CLI (this is also what ``torchrun -m ember`` executes)."""

from ember.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
