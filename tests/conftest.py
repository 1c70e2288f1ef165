import os
import sys

# Tests import the repo's own package (also when run without the editable install) and the
# multiproc launcher helpers.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")
