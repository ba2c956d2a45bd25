from areal_aio.cli import main

raise SystemExit(main())
