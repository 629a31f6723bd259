"""``python -m kvforensics.simulate --seed 7 --out data/sample``."""

from kvforensics.simulate.cli import main

raise SystemExit(main())
