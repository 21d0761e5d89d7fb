"""Stage 1 of the request path: what a caller sends -> what the engine runs.

`prompt.py` validates a prompt and expands its image placeholders, `tokenizer.py` holds the tokenizer and chat
template, `image_io.py` loads untrusted images safely, `image.py` resizes and patchifies them (lesson 01) and
`pool.py` does the image work on worker threads (lesson 07); `compression.py` says how many visual tokens an image
keeps and which (lesson 10), and its `encode_visual_tokens` is the encode stage: the vision tower, then the policy.
`old_images.py` says what a long chat's older pictures become: kept, dropped, downscaled or compressed (lesson 16).
`video_io.py` loads clips safely and `video.py` makes their frames into temporal patches (lesson 17); only a video
imports them.
"""
