// The floor of a ring all_reduce's traffic over loopback TCP, for docs/BENCHMARKS.md ("Where a
// 4-rank all_reduce over loopback spends its time"). Build: gcc -O2 -march=native -o ringfloor
// ringfloor.c. Run: ./ringfloor N BYTES ITERS BASEPORT [REDUCE]: N processes on ports
// BASEPORT..BASEPORT+N-1, 2(N-1) steps each sending a block to the next rank and receiving one
// from the previous, REDUCE=1 adding each received block as float32; prints rank 0's median.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <fcntl.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e6+t.tv_nsec/1e3;}
static int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(int argc,char**argv){
  int n=atoi(argv[1]); size_t bytes=atol(argv[2]); int iters=atoi(argv[3]); int base=atoi(argv[4]);
  int reduce = argc>5 ? atoi(argv[5]) : 0;
  int rank=0; for(int i=1;i<n;i++){ if(fork()==0){rank=i;break;} }
  int ls=socket(AF_INET,SOCK_STREAM,0); int one=1; setsockopt(ls,SOL_SOCKET,SO_REUSEADDR,&one,4);
  struct sockaddr_in a={0}; a.sin_family=AF_INET; a.sin_addr.s_addr=htonl(0x7f000001); a.sin_port=htons(base+rank);
  if(bind(ls,(void*)&a,sizeof a)){perror("bind");return 1;} listen(ls,4);
  int nx=socket(AF_INET,SOCK_STREAM,0); a.sin_port=htons(base+(rank+1)%n);
  while(connect(nx,(void*)&a,sizeof a)){close(nx);usleep(10000);nx=socket(AF_INET,SOCK_STREAM,0);}
  int pv=accept(ls,0,0);
  setsockopt(nx,IPPROTO_TCP,TCP_NODELAY,&one,4); setsockopt(pv,IPPROTO_TCP,TCP_NODELAY,&one,4);
  fcntl(nx,F_SETFL,O_NONBLOCK); fcntl(pv,F_SETFL,O_NONBLOCK);
  size_t blk=bytes/n; char*data=malloc(bytes); char*tmp=malloc(blk); memset(data,1,bytes); memset(tmp,0,blk);
  double*t=malloc(sizeof(double)*iters);
  for(int it=0;it<iters;it++){
    double t0=now();
    for(int s=0;s<2*(n-1);s++){
      char*sb=data+((rank-s+n)%n)*blk; char*rb = s<n-1 ? tmp : data+((rank-s-1+2*n)%n)*blk;
      size_t so=0,ro=0;
      while(so<blk||ro<blk){
        struct pollfd p[2]={{nx,so<blk?POLLOUT:0,0},{pv,ro<blk?POLLIN:0,0}};
        poll(p,2,-1);
        if(so<blk){ssize_t k=send(nx,sb+so,blk-so>(1<<20)?(1<<20):blk-so,MSG_DONTWAIT); if(k>0)so+=k;}
        if(ro<blk){ssize_t k=recv(pv,rb+ro,blk-ro,MSG_DONTWAIT); if(k>0)ro+=k; else if(k==0){fprintf(stderr,"eof\n");return 1;}}
      }
      if(reduce && s<n-1){float*d=(float*)(data+((rank-s-1+2*n)%n)*blk);float*x=(float*)tmp;for(size_t i=0;i<blk/4;i++)d[i]+=x[i];}
    }
    t[it]=now()-t0;
  }
  if(rank==0){qsort(t,iters,sizeof(double),cmp); printf("n=%d bytes=%zu reduce=%d median %.1f us (min %.1f)\n",n,bytes,reduce,t[iters/2],t[0]);}
  if(rank==0) for(int i=1;i<n;i++) wait(0);
  return 0;
}
