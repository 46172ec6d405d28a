"""Helpers shared by the test files: models, launchers, references. Fixtures stay in
the ``conftest.py`` files; everything here is imported one way,
``from tests._helpers.<module> import ...``.

* models: :mod:`.models` (the tiny leantrain GPT), :mod:`.hf_models` (tiny Hugging
  Face models and batches), :mod:`.muon_models` (a matrix-only MLP),
  :mod:`.kfac_models` (K-FAC's small models, batches and one-step helpers),
  :mod:`.curv_models` (the float64 models of the curvature tests) and
  :mod:`.curv_blocks` (their block structure from first principles),
  :mod:`.lp_steps` (layer-parallel steps);
* training tasks and loops: :mod:`.hf_tasks` (one task per HF family),
  :mod:`.optim_patterns` and :mod:`.precond_patterns` (the pattern matrices'
  models and loops), :mod:`.gefen_steps` (param groups, one step),
  :mod:`.fused_states` (states and codebooks of the fused-step tests);
* launchers: :mod:`.launchers` (N gloo processes), :mod:`.gefen_workers` (the
  Gefen distributed workers);
* references: :mod:`.kron_reference`, :mod:`.ng_reference`,
  :mod:`.linear_reference` (slow, obvious versions to compare against);
* :mod:`.source_scan`: the library's source for the static checks.
* :mod:`.compare_configs`: tiny settings of the ``leantrain compare`` axes.
"""
