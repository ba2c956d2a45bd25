from areal_aio.app.cli import main

raise SystemExit(main())
