"""Translation (the paper's sections 5-6.2): scoring with every BLEU variant, and the task's evaluator."""
