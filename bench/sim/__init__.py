"""The cluster simulator (`pdserve sim`): simulated engines on a virtual clock behind the
real router, admission and conditional-disaggregation code."""
