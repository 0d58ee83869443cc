"""Reliability drills: real engines and bench clients on 127.0.0.1, driven into faults, overload,
bad input and vanishing readers, each drill bounded in time and count and reported as one `DrillRow`.

`python -m drills [--quick] [NAME ...]` prints the table and exits 1 if any drill failed.
"""
