"""Building blocks of the models: linears, norms, rotary embedding, routers, the routed MoE block, attention."""
