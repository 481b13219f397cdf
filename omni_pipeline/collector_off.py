"""Named first in a fork server's preload (`lifecycle.preload`): the cyclic garbage collector
off while the server imports torch and transformers. Those imports make some 400k objects that
live as long as the process; with the collector on, it walks them again and again as they are
made, a fifth of the import's CPU (1.6 s of 7.5 here), in every `omni serve`. The server itself
only forks from then on; each child freezes what it inherited and turns the collector back on
(`lifecycle.settle_forked_child`)."""

import gc

gc.disable()
