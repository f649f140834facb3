"""Self-debugging code evaluation (issue 6): datasets (HumanEval, MBPP), the generate -> test ->
feedback -> repair loop and its reports; untrusted code runs in `sandbox`."""
