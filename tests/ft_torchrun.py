"""A replica group's training script as torchrun runs it (tests/test_ft_groups.py):
``torchrun ... tests/ft_torchrun.py ARGS_JSON``, with REPLICA_GROUP_ID and the plan's
lighthouse set by the test. Calls :func:`tests.ft_workers.train` with the JSON's keyword
arguments; torchrun's restart N of the group trains as the group's name + "b" * N."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta


def main() -> None:
    import torch
    import torch.distributed as dist

    from tests import ft_workers

    torch.set_num_threads(1)
    args = json.loads(sys.argv[1])
    # torchrun's restarts of the group (--max-restarts) write files of their own: g1b.
    group = args.pop("group") + "b" * int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    ft_workers.train(args.pop("plan"), args.pop("rundir"), group, args.pop("steps"), **args)
    sys.stdout.flush()
    sys.stderr.flush()
    # torchft's manager server and transports hold threads: leave without joining them.
    os._exit(0)


if __name__ == "__main__":
    main()
