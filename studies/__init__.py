"""Research programs built on the measurement tools in eval/: each a package with its runner,
tables and plots.

- studies.gating: what the gate buys (EG-MLA against MLA and MHA, with controls), docs/study.md;
- studies.locality: activation locality and sparse decoding, docs/activation_locality.md;
- studies.upcycling: converting a pretrained model to MLA and EG-MLA, docs/upcycling.md.

A study may import eval/, serve/ and egmla/; nothing there imports a study
(tests/test_seams.py). Their records stay under benchmarks/results/.
"""
