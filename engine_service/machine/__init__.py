"""The machine: what this CPU can do (cpu.py) and the precision chosen from it and from the
weights' file (precision.py: float32, bfloat16 or float16; int4/int8 quantized copies). Decided at
run time, never tuned for one CPU.
"""
