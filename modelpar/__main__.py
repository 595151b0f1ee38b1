"""``python -m modelpar`` is the same as the ``modelpar`` command."""

from modelpar.cli import main

raise SystemExit(main())
