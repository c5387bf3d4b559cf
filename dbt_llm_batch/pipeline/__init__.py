"""The stages of one run of one model (validate, plan, request files, budget, submit, reconcile,
harvest, realtime, merge) and the run that sequences them. See ARCHITECTURE.md, "The run"."""
