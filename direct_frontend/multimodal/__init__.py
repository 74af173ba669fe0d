"""Images in: content parts, safe fetching, per-family preprocessing, image hashes.

A vision-language model served over the direct gRPC path sees token ids, so the
router owns the multimodal front end as it owns the text one: it fetches each
image (:mod:`.fetch`, under :mod:`.policy`'s limits and address rules),
decodes and preprocesses it as the model's reference processor does
(:mod:`.processors`), expands the prompt's placeholder tokens to each image's
length and hands the engines the tensors, the placeholder ranges and a hash
per image (:mod:`.payload`). Everything here but :mod:`.fetch` is sans-IO.
"""
