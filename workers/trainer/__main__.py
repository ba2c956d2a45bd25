from areal_aio.workers.trainer.worker import main

raise SystemExit(main())
