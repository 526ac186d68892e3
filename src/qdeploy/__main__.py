"""``python -m qdeploy`` (and ``torchrun ... -m qdeploy qat ...``): the CLI."""
from qdeploy.cli import main

raise SystemExit(main())
