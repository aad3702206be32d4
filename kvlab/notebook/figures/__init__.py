"""Each lesson's figures (and the tables and checks beside them), one module per lesson, named after its notebook:
torch_cat (01, 02, 04, A4, A6), strategies (04), analysis (03, A5), compare (kvlab.compare, A5), encoder_decoder
(A10, A7), todays_generate (05), will_it_fit (06, A11), speed (A2), torch_cat_depth (A3), tuple_vs_dynamic_depth
(A4)."""
