from areal_aio.workers.common import exit_now
from areal_aio.workers.trainer.worker import main

exit_now(main())
