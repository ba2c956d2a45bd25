from areal_aio.workers.rollout.worker import main

raise SystemExit(main())
