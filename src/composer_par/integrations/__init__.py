"""Run a plan inside the trainers people already use.

One module per trainer, each importing its trainer only when used, so that importing one
adapter needs none of the others installed (nor does ``import composer_par``):

* :mod:`composer_par.integrations.lightning`: Lightning Fabric and the Lightning Trainer
  (extra ``composer-par[lightning]``);
* :mod:`composer_par.integrations.accelerate`: Hugging Face accelerate (extra
  ``composer-par[accelerate]``);
* :mod:`composer_par.integrations.hf_trainer`: the Hugging Face Trainer, through the
  accelerate adapter (extra ``composer-par[hf]``);
* :mod:`composer_par.integrations.ray`: Ray Train's ``TorchTrainer`` workers, sized by
  the plan (extra ``composer-par[ray]``).

Each adapter lets the plan own the mesh and the parallelism and turns off what the
trainer would do twice; a trainer setting that overlaps a plugin of the plan is refused
before anything is built, as a finding (codes CP7xx, docs/rules.md). docs/integrations.md
has the few lines a user adds for each.
"""
