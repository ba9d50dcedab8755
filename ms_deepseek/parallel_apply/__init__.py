"""Layer 5 (beside the model): the application of the parallel plan to a built model (:mod:`.apply`)
and the lint that checks the applied strategies against MindSpore's rules (:mod:`.lint`)."""
