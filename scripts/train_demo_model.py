"""Train the demo model (models/k3-demo-stdlib): see workers/model/train/run.py.

    python scripts/train_demo_model.py --out /tmp/demo --deadline 540

Distil an existing checkpoint's MTP drafter layer against its frozen target (workers/model/train/distill_mtp.py):

    python scripts/train_demo_model.py --distill-mtp --init models/k3-demo-stdlib --out /tmp/distill --seconds 60
"""

import sys

if __name__ == "__main__":
    if "--distill-mtp" in sys.argv[1:]:
        from k3serve.workers.model.train.distill_mtp import main
    else:
        from k3serve.workers.model.train.run import main
    sys.exit(main())
