"""Generative recommenders (issue 43): HSTU's jagged attention with FBGEMM's signature, the HSTU layer and a
sequential recommender (HSTU and SASRec) trained with a sampled softmax and evaluated by full ranking."""
