"""What we adapt to from outside: torchtitan 0.2.2 and its CPU/gloo shim (torchtitan.py), and torch's
functional collectives across versions (collectives.py). The ground floor: imports nothing of ours."""
