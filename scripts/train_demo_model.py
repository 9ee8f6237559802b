"""Train the demo model (models/k3-demo-stdlib): see workers/model/train/run.py.

    python scripts/train_demo_model.py --out /tmp/demo --deadline 540
"""

import sys

from k3serve.workers.model.train.run import main

if __name__ == "__main__":
    sys.exit(main())
