"""``python -m stageferry``: the same CLI as the ``stageferry`` command (``up`` starts services this way)."""

from stageferry.cli import main

if __name__ == "__main__":
    main()
