"""Generation: what a request asks of its tokens, as one object, and the batch operations on logits.

controls.py builds a request's `Controls` once (sampling, penalties, logit bias, min tokens, its
response_format's constraint, stop strings and streamed text, log-probabilities, speculation's
n-gram index) and is what the decode loop asks to prepare logits and to accept tokens. The rest are
its parts: sampler.py, logits_processors.py, constraint.py (llguidance), logprobs.py,
output_text.py, speculative.py (the n-gram index and draft verification). A new sampling option
goes here: a field of SamplingParams (requests.py), its processor, and its line in Controls.
"""
