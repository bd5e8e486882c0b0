import os
import sys

from zero_lifetime.single_rank import single_rank_env

# DeepSpeed on the CPU: gloo collectives, one process is rank 0 of 1 unless a test spawns more.
single_rank_env()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
