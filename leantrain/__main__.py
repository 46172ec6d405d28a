from leantrain.cli import main

# Guarded: spawned worker processes import the main module again.
if __name__ == "__main__":
    raise SystemExit(main())
